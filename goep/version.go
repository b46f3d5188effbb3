package goep

// Version of pyep; setup.py reads it from here.
const Version = "0.1.0"
