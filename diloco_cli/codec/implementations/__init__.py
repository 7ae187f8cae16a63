"""The built-in codecs, one module each (a family of like codecs shares one), registered
by name in :data:`diloco_cli.codec.registry.known_codecs`."""
