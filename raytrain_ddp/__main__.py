from raytrain_ddp.cli import main

main()
