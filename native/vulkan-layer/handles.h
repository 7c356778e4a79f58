/* Which record belongs to a dispatchable Vulkan handle (an instance, a device), found by the handle's dispatch key.
 *
 * Lookups take no lock: they run on every vkAllocateMemory, vkFreeMemory and throttled submit of every thread.
 * Entries are never freed while the process lives; a dropped one is reused by the next insert into its bucket, so
 * memory stays bounded by the most handles alive at once, and there is no limit on how many that is.
 */
#ifndef GPUPPETTI_HANDLES_H
#define GPUPPETTI_HANDLES_H

#include <stdatomic.h>
#include <stdbool.h>

#include "spin.h"

#define HANDLE_BUCKETS 256

struct handle_entry {
    _Atomic(void *) key; /* NULL: free for reuse */
    _Atomic(void *) value;
    struct handle_entry *_Atomic next;
};

struct handle_map {
    spin_t writers;
    struct handle_entry *_Atomic buckets[HANDLE_BUCKETS];
};

void *handles_find(struct handle_map *map, const void *key);
/* False only when no memory is left for a new entry. */
bool handles_put(struct handle_map *map, void *key, void *value);
void handles_drop(struct handle_map *map, const void *key);

#endif
