#include "handles.h"

#include <stdint.h>
#include <stdlib.h>

static unsigned bucket_of(const void *key)
{
    uint64_t value = (uint64_t)(uintptr_t)key;
    value ^= value >> 33;
    value *= 0xff51afd7ed558ccdULL;
    value ^= value >> 33;
    return (unsigned)(value % HANDLE_BUCKETS);
}

void *handles_find(struct handle_map *map, const void *key)
{
    if (key == NULL) {
        return NULL;
    }
    struct handle_entry *entry = atomic_load_explicit(&map->buckets[bucket_of(key)], memory_order_acquire);
    for (; entry != NULL; entry = atomic_load_explicit(&entry->next, memory_order_acquire)) {
        if (atomic_load_explicit(&entry->key, memory_order_acquire) == key) {
            return atomic_load_explicit(&entry->value, memory_order_acquire);
        }
    }
    return NULL;
}

bool handles_put(struct handle_map *map, void *key, void *value)
{
    unsigned bucket = bucket_of(key);
    bool stored = false;
    spin_lock(&map->writers);
    struct handle_entry *head = atomic_load_explicit(&map->buckets[bucket], memory_order_relaxed);
    for (struct handle_entry *entry = head; entry != NULL && !stored; entry = atomic_load(&entry->next)) {
        if (atomic_load_explicit(&entry->key, memory_order_relaxed) == NULL) {
            /* The value first: a reader that sees the key sees its value. */
            atomic_store_explicit(&entry->value, value, memory_order_release);
            atomic_store_explicit(&entry->key, key, memory_order_release);
            stored = true;
        }
    }
    if (!stored) {
        struct handle_entry *entry = calloc(1, sizeof *entry);
        if (entry != NULL) {
            atomic_init(&entry->key, key);
            atomic_init(&entry->value, value);
            atomic_init(&entry->next, head);
            atomic_store_explicit(&map->buckets[bucket], entry, memory_order_release);
            stored = true;
        }
    }
    spin_unlock(&map->writers);
    return stored;
}

void handles_drop(struct handle_map *map, const void *key)
{
    spin_lock(&map->writers);
    struct handle_entry *entry = atomic_load_explicit(&map->buckets[bucket_of(key)], memory_order_relaxed);
    for (; entry != NULL; entry = atomic_load(&entry->next)) {
        if (atomic_load_explicit(&entry->key, memory_order_relaxed) == key) {
            atomic_store_explicit(&entry->key, NULL, memory_order_release);
            break;
        }
    }
    spin_unlock(&map->writers);
}
