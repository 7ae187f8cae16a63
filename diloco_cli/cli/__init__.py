"""The command line: thin typer commands that parse, call one library function, render."""
