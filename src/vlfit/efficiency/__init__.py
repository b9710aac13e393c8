"""Compute efficiency: FLOPs per sample counted on a real step, device peaks, TFLOP/s and MFU."""
