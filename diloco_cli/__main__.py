from diloco_cli.cli.app import main

main()
