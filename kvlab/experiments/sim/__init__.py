"""The roofline simulator: its core, command line, the seed article's presets, and online serving (serve/)."""
