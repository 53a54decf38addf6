"""Fuzz drivers for the sans-IO protocol decoders (``make fuzz``)."""
