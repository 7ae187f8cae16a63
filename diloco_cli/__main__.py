from diloco_cli.cli.entry import main

main()
