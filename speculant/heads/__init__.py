"""Draft heads that read the target's hidden states: Medusa, EAGLE-2, EAGLE-3.

config.py (HeadConfig), layer.py (the decoder layer), modules.py (the heads), formats.py (checkpoint
layouts: ours, FasterDecoding Medusa, EAGLE / EAGLE-3 yuhuili and speculators), store.py (where heads
live: SPECULANT_HOME/heads/NAME). What a head method loads is methods/heads.py. Training them (`speculant
train-heads`) lives in speculant/training, which imports this package and never the reverse.
"""
