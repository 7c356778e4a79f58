/* What the fake driver (fake_icd.c) and the harness share: how a fake GPU is named, and what reached the driver.
 *
 * The harness finds fake_icd_stats with dlsym in the very library the Vulkan loader loaded (dlopen with
 * RTLD_NOLOAD): what it reads is what the driver below the layer saw, not what the layer says.
 */
#ifndef GPUPPETTI_FAKE_ICD_H
#define GPUPPETTI_FAKE_ICD_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include <vulkan/vulkan.h>

#define FAKE_ICD_MAX_GPUS 8
#define FAKE_ICD_MAX_HEAPS 8
#define FAKE_ICD_STATS_SYMBOL "fake_icd_stats"

/* GPU i's deviceUUID: fa1ce000-0000-4000-8000-0000000000ii (as a selector, uuid:GPU-fa1ce000-...-0000000000ii). */
static inline void fake_icd_uuid(uint32_t gpu, uint8_t uuid[VK_UUID_SIZE])
{
    static const uint8_t prefix[VK_UUID_SIZE - 1] = {0xfa, 0x1c, 0xe0, 0x00, 0x00, 0x00, 0x40, 0x00,
                                                     0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    memcpy(uuid, prefix, sizeof prefix);
    uuid[VK_UUID_SIZE - 1] = (uint8_t)gpu;
}

/* The fake GPU a deviceUUID names, or -1 where it names none. */
static inline int fake_icd_gpu_of(const uint8_t uuid[VK_UUID_SIZE])
{
    uint8_t first[VK_UUID_SIZE];
    fake_icd_uuid(0, first);
    if (memcmp(uuid, first, VK_UUID_SIZE - 1) != 0 || uuid[VK_UUID_SIZE - 1] >= FAKE_ICD_MAX_GPUS) {
        return -1;
    }
    return uuid[VK_UUID_SIZE - 1];
}

/* One GPU's record, for this process, since it loaded the driver. */
struct fake_icd_stats {
    uint64_t allocations;    /* vkAllocateMemory calls that reached the driver */
    uint64_t refusals;       /* of those, the ones the driver refused: the heap had no room */
    uint64_t bad_calls;      /* calls the driver could not have served: a handle it never gave out or had freed
                              * already, a memory type it does not have, an extension it does not offer */
    uint64_t devices;        /* devices created */
    uint64_t budget_enabled; /* of those, the ones created with VK_EXT_memory_budget enabled */
    VkDeviceSize in_use[FAKE_ICD_MAX_HEAPS]; /* what this process holds of each heap */
};

/* GPU gpu's record; false for a GPU the configuration does not have. The harness reaches it with dlsym. */
bool fake_icd_stats(uint32_t gpu, struct fake_icd_stats *out);
typedef bool (*fake_icd_stats_function)(uint32_t gpu, struct fake_icd_stats *out);
/* What runs once, in the next vkFreeMemory, just after the driver freed the handle (FAKE_ICD_REUSE=1 hands it out
 * again next): another thread's allocation in the layer's window. Reached with dlsym, like fake_icd_stats. */
typedef void (*fake_icd_hook)(void);
#define FAKE_ICD_AFTER_FREE_SYMBOL "fake_icd_after_free"
void fake_icd_after_free(fake_icd_hook hook);
typedef void (*fake_icd_after_free_function)(fake_icd_hook hook);

#endif
