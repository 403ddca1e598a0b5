"""The reliability suite: security defaults, hostile frames, crash and disk faults, the soak."""
