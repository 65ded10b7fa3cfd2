FIELDS = ()
