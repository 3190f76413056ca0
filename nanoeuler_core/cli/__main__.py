from nanoeuler_core.cli import main

main()
