"""The CLI's commands that are not the daemon itself: doctor, inspect, models, train."""
