"""Pickers: turn the candidates' utilities into one choice. See README.md."""
