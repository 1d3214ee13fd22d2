"""The names `EngineConfig.linear` takes (common/linear.py), importable without torch."""

LINEAR_CHOICES = ("auto", "onednn", "torch")
