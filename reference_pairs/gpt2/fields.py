from parity.fields import Field
FIELDS = ()
