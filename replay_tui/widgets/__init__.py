"""The debugger's panes, one per module."""
