"""The `deepspeed` launcher: `runner` parses the command line, `launch` starts and supervises ranks.

Single node only. The launcher runs each rank as a plain subprocess and stays out of the
comm layer; the ranks set up their process group themselves (`deepspeed.comm`).
"""
