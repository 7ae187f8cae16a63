"""The pure algorithm of Decoupled DiLoCo: tensor math and the syncer's decisions.

Nothing in this package reads files, talks to a network or looks at a clock; time and
data come in as arguments.  Storage, processes and terminals live in other layers.
"""
