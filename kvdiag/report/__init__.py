"""Renderings of samples and verdicts for people: terminal views and the HTML report."""
