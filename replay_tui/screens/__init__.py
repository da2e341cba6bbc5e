"""Screens: help, error, jump-to-sample."""
