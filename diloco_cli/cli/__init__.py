"""The command line: thin click commands that parse, call one library function, render."""
