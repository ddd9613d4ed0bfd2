"""The corpus's entries, by whose code they are: transformers' families (``hf`` and the families in
``hf_decoders`` and ``hf_others``), torchtitan's models (``titan``), scripts written the way research
code is (``scripts``), and the models drawn from the block grammar (``grammar``, their code in
``blocks``). Importing a module registers its entries (``registry.register``)."""
