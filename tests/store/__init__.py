"""Tests of the built-in Store."""
