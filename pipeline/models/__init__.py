"""Backbones as block lists (``zoo``) and weights files (``weights``)."""
