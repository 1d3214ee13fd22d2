"""The reserve baseline backend (Orca/FasterTransformer-style whole-region reservation)."""
