"""Flower's quickstart-pytorch on fedagg's public API."""
