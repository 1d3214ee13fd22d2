"""What the experiments send: request lengths and arrivals, and prefix-structured prompts."""
