"""Where a model comes from, and the one resolver of a reference to it (`load_model`).

    loading    load_model(reference): the built-in model, a published name or TF-Hub handle, original
               options + HDF5 files (paths or URLs), a native folder, an ELMoForManyLangs folder,
               a TF-Hub module folder or archive
    published  the published models by name, their URLs and what is known of their files
    download   fetching a URL into the cache (capped, checked, one download among processes)
    cache      the cache's layout: where a URL's file lives, what the cache holds, its locks
    tfhub      TF-Hub module folders, archives and TF-Hub's own cache (the checkpoint format
               itself: `elmokit.model.tf_bundle`)

The formats are read by `elmokit.model` (`weights`, `manylangs`, `tf_bundle`); this package
finds the files and chooses the reader.
"""
