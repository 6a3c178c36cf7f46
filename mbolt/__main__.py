from mbolt.cli import main

main()
