"""Experiments: the harnesses that turn the methods into reports (the demo, Xu et al.'s analysis, NPM's tasks) and
their plots."""
