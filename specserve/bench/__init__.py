"""Measuring servers: prompt suites, load generation, reports."""
