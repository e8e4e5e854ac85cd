from blockdiff.cli import main

main()
