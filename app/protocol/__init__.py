"""Wire protocol shared by the gateway and the workers: block keys, engine error codes, schemas."""
