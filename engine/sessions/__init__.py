"""The session bank: prefix-keyed cache snapshots in RAM and on disk (bank.py is the entry)."""
