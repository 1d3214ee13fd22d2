"""Backends that live only in the tests: proof that a backend plugs in through the registry alone."""
