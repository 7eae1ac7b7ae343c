// data.h: everything of the data pipeline in one include: corpus readers, the BPE tokenizer, token
// shards, the loader and `prepare_dataset`. Each part also has its own header under moetron/data/.
#pragma once
#include "moetron/data/corpus.h"
#include "moetron/data/crc32c.h"
#include "moetron/data/loader.h"
#include "moetron/data/prepare.h"
#include "moetron/data/shard.h"
#include "moetron/data/tokenizer.h"
