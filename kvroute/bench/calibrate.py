def add_calibrate_parser(sub):
    pass
