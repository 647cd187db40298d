"""Filters: hard constraints (and narrowing rules) that return a subset of the candidates. See README.md."""
