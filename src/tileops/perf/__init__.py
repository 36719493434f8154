"""Measuring: GPU profiles, the timing protocol, roofline math and benchmark rows."""
