"""``megathunder bench NAME``: each module has ``main(argv) -> int`` and prints a JSON last line."""
