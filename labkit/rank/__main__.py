"""`torchrun ... -m labkit.rank --connect HOST:PORT --key-file F`: a rank that attaches to a lab."""

from labkit.rank.torchrun_entry import main

main()
