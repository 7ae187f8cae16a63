import sys

try:
    from diloco_cli.cli.app import main
except KeyboardInterrupt:  # Ctrl-C while the command was loading: it had done nothing
    print("interrupted while diloco was loading; nothing was done", file=sys.stderr)
    sys.exit(130)

main()
