#define _GNU_SOURCE
#include "slices.h"

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Hex digits, dashes ignored (GPU-8b2e4c1a-... and 8b2e4c1a... name the same UUID), exactly 16 bytes. */
static bool parse_uuid(const char *text, size_t length, uint8_t uuid[16])
{
    int nibbles = 0;
    for (size_t i = 0; i < length; i++) {
        if (text[i] == '-') continue;
        int value = hex_digit(text[i]);
        if (value < 0 || nibbles >= 32) return false;
        if (nibbles % 2 == 0) uuid[nibbles / 2] = (uint8_t)(value << 4);
        else uuid[nibbles / 2] |= (uint8_t)value;
        nibbles++;
    }
    return nibbles == 32;
}

static bool parse_entry(const char *text, size_t length, struct slice *slice)
{
    const char *equals = memchr(text, '=', length);
    if (equals == NULL) return false;
    size_t selector_length = (size_t)(equals - text);
    char number[32];
    size_t number_length = length - selector_length - 1;
    if (number_length == 0 || number_length >= sizeof number) return false;
    memcpy(number, equals + 1, number_length);
    number[number_length] = '\0';
    char *end = NULL;
    errno = 0;
    unsigned long long budget = strtoull(number, &end, 10);
    if (errno != 0 || *end != '\0' || budget > (unsigned long long)LLONG_MAX) return false;
    slice->budget = (int64_t)budget;

    if (selector_length == 3 && memcmp(text, "any", 3) == 0) {
        slice->kind = SELECT_ANY;
        return true;
    }
    if (selector_length > 4 && memcmp(text, "pci:", 4) == 0) {
        char address[32];
        if (selector_length - 4 >= sizeof address) return false;
        memcpy(address, text + 4, selector_length - 4);
        address[selector_length - 4] = '\0';
        unsigned domain, bus, device, function;
        char tail;
        if (sscanf(address, "%x:%x:%x.%x%c", &domain, &bus, &device, &function, &tail) != 4) return false;
        slice->kind = SELECT_PCI;
        slice->pci_domain = domain;
        slice->pci_bus = bus;
        slice->pci_device = device;
        slice->pci_function = function;
        return true;
    }
    if (selector_length > 5 && memcmp(text, "uuid:", 5) == 0) {
        slice->kind = SELECT_UUID;
        const char *uuid = text + 5;
        size_t uuid_length = selector_length - 5;
        if (uuid_length > 4 && memcmp(uuid, "GPU-", 4) == 0) {
            uuid += 4;
            uuid_length -= 4;
        }
        return parse_uuid(uuid, uuid_length, slice->uuid);
    }
    return false;
}

bool slices_parse(const char *text, struct slices *out)
{
    memset(out, 0, sizeof *out);
    if (text == NULL || *text == '\0') return false;
    const char *cursor = text;
    while (*cursor != '\0') {
        const char *comma = strchr(cursor, ',');
        size_t length = comma != NULL ? (size_t)(comma - cursor) : strlen(cursor);
        if (out->count >= MAX_SLICES || !parse_entry(cursor, length, &out->items[out->count])) {
            memset(out, 0, sizeof *out);
            return false;
        }
        out->count++;
        cursor += length;
        if (*cursor == ',') cursor++;
    }
    out->active = out->count > 0;
    for (int i = 0; i < out->count; i++) {
        out->items[i].compute = 1000;
    }
    return out->active;
}

bool slices_parse_compute(const char *text, struct slices *slices)
{
    int shares[MAX_SLICES];
    int count = 0;
    const char *cursor = text;
    bool parsed = text != NULL && *text != '\0';
    while (parsed && *cursor != '\0') {
        char *end = NULL;
        errno = 0;
        long share = strtol(cursor, &end, 10);
        parsed = errno == 0 && end != cursor && share >= 1 && share <= 1000 && count < MAX_SLICES &&
                 (*end == ',' || *end == '\0');
        if (parsed) {
            shares[count++] = (int)share;
            cursor = *end == ',' ? end + 1 : end;
            parsed = !(*end == ',' && *cursor == '\0');
        }
    }
    parsed = parsed && count == slices->count;
    for (int i = 0; i < slices->count; i++) {
        slices->items[i].compute = parsed ? shares[i] : 1000;
    }
    return parsed;
}

static struct slices loaded;
static atomic_int state; /* 0: not yet, 1: loading, 2: loaded */

const struct slices *slices_get(void)
{
    int expected = 0;
    if (atomic_compare_exchange_strong(&state, &expected, 1)) {
        struct slices parsed;
        if (slices_parse(getenv("GPUPPETTI_VK_SLICES"), &parsed)) {
            slices_parse_compute(getenv("GPUPPETTI_VK_COMPUTE"), &parsed);
            const char *directory = getenv("GPUPPETTI_VK_ACCOUNTING");
            for (int i = 0; i < parsed.count; i++) {
                char path[4096];
                int written = directory != NULL
                    ? snprintf(path, sizeof path, "%s/slice-%d.acct", directory, i) : -1;
                bool fits = written > 0 && written < (int)sizeof path;
                acct_open(&parsed.items[i].acct, fits ? path : NULL, parsed.items[i].budget);
            }
        }
        loaded = parsed;
        atomic_store(&state, 2);
    } else {
        while (atomic_load(&state) != 2) {
            /* Another thread is reading the environment: a few microseconds, once per process. */
        }
    }
    return &loaded;
}
