"""`ampdoctor init`: a starter spec from the AST of the user's file (spec), its command
line options (script) and a proposed loss (loss). Static layer: never runs the file, no
torch."""
