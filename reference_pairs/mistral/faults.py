FAULTS = ()
