"""The jaxpr engine under autocast, precision_report and numerics_report.

How it works and how to extend it: README.md in this folder.
"""
