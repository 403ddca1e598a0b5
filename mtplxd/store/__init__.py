"""The models folder: resolving a model name, pulling from the Hub, converting."""
