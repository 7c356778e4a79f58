#define _GNU_SOURCE
#include "slices.h"

#include "ledger.h"

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
    size_t entries = 1;
    for (const char *c = text; *c != '\0'; c++) {
        entries += *c == ',';
    }
    if (entries > INT_MAX / 2) return false;
    out->items = calloc(entries, sizeof *out->items);
    if (out->items == NULL) return false;
    const char *cursor = text;
    while (*cursor != '\0') {
        const char *comma = strchr(cursor, ',');
        size_t length = comma != NULL ? (size_t)(comma - cursor) : strlen(cursor);
        if ((size_t)out->count >= entries || !parse_entry(cursor, length, &out->items[out->count])) {
            slices_free(out);
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
    if (!out->active) slices_free(out);
    return out->active;
}

void slices_free(struct slices *slices)
{
    free(slices->items);
    memset(slices, 0, sizeof *slices);
}

/* One share: 1 to 1000, then a comma and more or the end. Returns where the next one starts, or NULL. */
static const char *parse_share(const char *cursor, int *share)
{
    char *end = NULL;
    errno = 0;
    long value = strtol(cursor, &end, 10);
    if (errno != 0 || end == cursor || value < 1 || value > 1000 || (*end != ',' && *end != '\0')) return NULL;
    if (*end == ',' && end[1] == '\0') return NULL;
    *share = (int)value;
    return *end == ',' ? end + 1 : end;
}

bool slices_parse_compute(const char *text, struct slices *slices)
{
    /* First whether it parses and names one share per slice, then the shares: nothing half-applied. */
    int count = 0, share = 0;
    bool parsed = text != NULL && *text != '\0';
    for (const char *cursor = text; parsed && *cursor != '\0'; count++) {
        cursor = parse_share(cursor, &share);
        parsed = cursor != NULL && count < slices->count;
    }
    parsed = parsed && count == slices->count;
    const char *cursor = text;
    for (int i = 0; i < slices->count; i++) {
        slices->items[i].compute = 1000;
        if (parsed) {
            cursor = parse_share(cursor, &slices->items[i].compute);
        }
    }
    return parsed;
}

static struct slices loaded;
static atomic_int state; /* 0: not yet, 1: loading, 2: loaded */

static void say(const char *what, const char *value)
{
    fprintf(stderr, "gpuppetti Vulkan layer: %s=%.200s does not parse; %s\n", what, value,
            strcmp(what, "GPUPPETTI_VK_SLICES") == 0 ? "this process is not held to a slice"
                                                     : "no slice of this process is throttled");
}

const struct slices *slices_get(void)
{
    int expected = 0;
    if (atomic_compare_exchange_strong(&state, &expected, 1)) {
        struct slices parsed;
        const char *text = getenv("GPUPPETTI_VK_SLICES");
        if (slices_parse(text, &parsed)) {
            const char *compute = getenv("GPUPPETTI_VK_COMPUTE");
            if (!slices_parse_compute(compute, &parsed) && compute != NULL) {
                say("GPUPPETTI_VK_COMPUTE", compute);
            }
            ledger_setup(&parsed);
        } else if (text != NULL) {
            say("GPUPPETTI_VK_SLICES", text);
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
