from gradbus.cli import main

main()
