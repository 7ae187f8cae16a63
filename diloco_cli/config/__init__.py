"""Typed, validated, frozen configuration: recipes (what to train) and regions (where).

Precedence: the defaults in these models < a YAML file < ``--set key=value`` flags.
"""
