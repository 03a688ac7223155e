"""The training engine the recipes share: config and sections, processes, build, loop, checkpoint, metrics, export."""
