"""`python -m alpasim.cli`: the `alpasim` command."""

from alpasim.cli import main

main()
