"""The tool nodes (Save, Resize, Extract, Convert) and their command line."""
